"""Warm starts: a rank forked from a process that has already imported torch (hpkit.warm.zygote), asked for by a
thin client that the launcher starts in the rank's place (hpkit.warm.client). Standard library only."""
