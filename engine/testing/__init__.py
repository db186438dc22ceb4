"""The engine's test seam, shipped so tests can drive a real daemon: a minimal greedy driver for parity
checks (`greedy`) and the fault hooks the reliability tests switch on through the environment (`faults`;
serving reaches them only through `faults.wrap_from_env`, which changes nothing unless the variable is set)."""
