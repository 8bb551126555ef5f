"""The engine: a round of every seed, vectorised over clients.

Above the methods and the config; below the run. `simulator` runs a round: it samples the
cohorts and cuts them into chunks of one model family (`schedule`), brings each chunk's rows from
where the population lives (`population`, `rows`) to one jitted call that runs the method's
hooks around every client's local training (`training`) under `vmap`, then the server rule;
`placement` and `distributed` put it on a device mesh and across processes; `evaluation` tests
the clients; `state` holds the typed pytrees between rounds, and `costs` counts FLOPs.
"""
