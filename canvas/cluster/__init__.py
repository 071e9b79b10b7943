"""Scale-out on Ray Serve: engine replicas behind one dcanvas/1 + HTTP ingress (`dcanvas serve --ray`).

Modules: `records` (what a replica's stream says first), `replica` (the `EngineReplica` deployment and the stats
board), `remote` (`RemoteAdmission`: the ingress's admission over the replicas), `deploy` (connect to Ray, deploy or
attach, scale), `cli` (`dcanvas cluster scale`). Only `replica`, `deploy` and `cli` import Ray, and the server
imports this package only with `--ray`: without it nothing here loads. Beside the server in the layers: imports
the engine's request types and `canvas.server.admission`; imported by `canvas.server` (`serve --ray`) and the CLI.
"""
