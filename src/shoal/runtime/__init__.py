"""Execution: workers, servers, data feeds and the loop that drives them."""
