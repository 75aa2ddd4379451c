"""bitmosaic's saved folders: writing them (:mod:`.save`, its shards :mod:`.shards`, the output folder's
lock and atomic replacement :mod:`.outdir`), reading and checking them (:mod:`.load`, the load's last step
:mod:`.finish`, transformers' ``from_pretrained``: :mod:`.hf_integration`), their file hashes
(:mod:`.integrity`) and the provenance their ``quantization_config`` records (:mod:`.provenance`)."""
