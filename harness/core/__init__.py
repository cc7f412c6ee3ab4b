"""What every layer shares: typed events, the value checks and the checks' typed settings."""
