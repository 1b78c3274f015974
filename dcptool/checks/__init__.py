"""What dcptool finds in checkpoints: inspect, verify, check, checksum, stats, layouts and load checks."""
