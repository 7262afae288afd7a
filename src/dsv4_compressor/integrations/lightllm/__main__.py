"""``python -m dsv4_compressor.integrations.lightllm``: runs :mod:`.launch` as the main module (``alter_sys``
makes it ``sys.modules["__main__"]``, so the processes LightLLM spawns re-run it by its own name)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dsv4_compressor.integrations.lightllm.launch", run_name="__main__", alter_sys=True)
