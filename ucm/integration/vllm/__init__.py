"""UCM for vLLM: ``UCMConnector`` (``ucm.integration.vllm.ucm_connector``). The only package that imports vLLM."""
