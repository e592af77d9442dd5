"""Model-server metrics, scraped in the background into the datastore (`scraper`): when, within a
pool-wide budget (`plan`), over a narrow HTTP/1.1 client (`http`), read with a narrow Prometheus
text reader (`prom_text`)."""
