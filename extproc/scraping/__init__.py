"""Model-server metrics, scraped in the background into the datastore (`scraper`), read with a
narrow Prometheus text reader (`prom_text`)."""
