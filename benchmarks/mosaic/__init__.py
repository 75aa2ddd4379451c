"""MosaicQuant: the model rows, the layer-level study, the sparse branch's kernel, the Atom-like baseline."""
