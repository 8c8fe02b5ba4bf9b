"""Continuous mode: the watcher that keeps a store's manifest fed, and its saved state."""
