"""`dcanvas bench soak`: writers edit, generate and accept against a real `dcanvas serve` while faults hit it on a
schedule drawn from a seed; afterwards a checker replays what each client was told against what the store holds.

Modules: `schedule` (the fault classes and when each fires), `server` (the server process: start, kill -9,
restart, resource samples), `writers` (the clients, each the only writer of its document, journalling every
answer), `actors` (the faults that are clients: a drop mid-generation, a client that never reads, a burst over
the queue bound), `cluster` (the faults of the scale-out deployment: replicas killed and stopped, the soak's own
PostgreSQL restarted and stopped, the ingress restarted; the processes sampled there), `checker` (the invariants),
`targets` (resource figures and the acceptance targets), `run` (the command: wires them together and prints the
report).

The top layer: imports the protocol client, the store (with its throwaway PostgreSQL, `pgserver`),
`canvas.server.faults` and the ingress's silent-replica timeout (`canvas.cluster.remote`); `canvas.bench` registers
it and its load benchmark starts servers with `server`.
Imports: `canvas`, `canvas.cluster`, `canvas.protocol`, `canvas.server` and `canvas.store`.
Imported by: `canvas.bench`.
"""
