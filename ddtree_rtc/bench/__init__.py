"""Benchmarks (also reachable as ``ddtree-rtc bench NAME``): each measures its own ceiling in the
same run and reports achieved / ceiling plus a peer."""
