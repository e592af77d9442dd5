"""Process wiring: `app` builds every part from the configuration, starts and drains them;
`workers` runs several picker processes on one port."""
