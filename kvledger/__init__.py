"""The `kvledger` application (the top layer): the command line, the local launcher, the
tools around the ledger core (hash, capacity, simulate, events) and their reports.

It is the only package that imports every role (`engine`, `gateway`, `gpu_worker`);
nothing imports it.
"""
