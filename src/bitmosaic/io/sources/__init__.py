"""Where a run's float model comes from: HF folders, hub ids, GGUF files and aliases, loaded whole
(:mod:`.loading`) or read one tensor at a time for a streamed run (:mod:`.opener`, :mod:`.checkpoint`,
:mod:`.gguf_checkpoint`), the checks of a float folder (:mod:`.float_check`) and the converted copies of
GGUF files (:mod:`.gguf_cache`)."""
