"""The engine: a round of every seed, vectorised over clients.

Above the methods and the config; below the run. `simulator` runs a round: it samples the
cohorts and cuts them into chunks of one model family (`schedule`; their size timed on the
machine by `per_call` where asked), brings each chunk's rows from where the population lives
(`population`, `rows`) to one jitted call that runs the method's hooks around every client's
local training (`training`) under `vmap`, then the server rule;
`parts` builds what a Simulator holds (the seeds' data, round 0), `costs` counts FLOPs;
`placement` and `distributed` put it on a device mesh and across processes; `evaluation` tests
the clients; `state` holds the typed pytrees between rounds and out of a chunk's call, and
`snapshots` turns the run state into checkpoints and back.
"""
