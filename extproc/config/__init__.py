"""Configuration: every default defined once (`settings`), each flag defined once (`flags`), and
start-up validation of the whole configuration (`validate`)."""
