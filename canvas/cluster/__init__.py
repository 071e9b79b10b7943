"""Scale-out on Ray Serve: engine replicas behind one dcanvas/1 + HTTP ingress (`dcanvas serve --ray`).

Modules: `records` (what a replica's stream says first), `replica` (the `EngineReplica` deployment and the stats
board), `remote` (`RemoteAdmission`: the ingress's admission over the replicas), `deploy` (connect to Ray, deploy or
attach, scale), `cli` (`dcanvas cluster scale`). Only `replica`, `deploy` and `cli` import Ray, and the server
imports this package only with `--ray`: without it nothing here loads.

Beside the server in the layers: it imports the engine's request types, its scheduling and its backend (in the
replicas) and `canvas.server.admission`; the server imports `deploy` (`serve --ray`), the soak the ingress's
silent-replica timeout (`remote`), and the CLI `cli`.
Imports: `canvas.engine` and `canvas.server`.
Imported by: `canvas.cli`, `canvas.server` and `canvas.soak`.
"""
