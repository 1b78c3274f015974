"""Commands that compute new values from several checkpoints: average and diff."""
