"""Engine integrations: a synchronous cold tier (embedded or through the daemon) and mlx-lm's server."""
