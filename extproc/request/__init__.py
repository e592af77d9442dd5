"""Parsing of OpenAI-style request bodies into what the scheduler needs."""
