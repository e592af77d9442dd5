"""Endpoint discovery: static lists and Kubernetes InferencePools feed the datastore."""
