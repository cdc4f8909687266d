"""Harness shared by the tests and the benchmarks: services run as child processes
(`processes`), and the routing simulation with its workloads (`routing_sim`,
`routing_workload`)."""
