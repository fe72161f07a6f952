"""The rank that holds a job up: the hang watchdog (its node board, cross-node channel and rule), the straggler
detector, and the fault injector that drills them."""
