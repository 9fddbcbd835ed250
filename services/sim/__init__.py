"""kvferry sim: a fleet simulator running the real router scheduling, prefix index and autoscaling policy."""
