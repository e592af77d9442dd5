"""Metrics: the picker's own Prometheus metrics, and scraping of model-server metrics."""
