"""Scheduling: filters narrow the candidates, scorers rate them, a picker chooses.

See extproc/scheduling/scheduler.py for the pipeline and interfaces.py for the plugin contracts.
"""
