"""Prefill/decode disaggregation through the shared UCM store: the xPyD proxy (:mod:`ucm.pd.proxy`)."""
