"""The launcher's main module: ``python -m dsv4_compressor.integrations.lightllm [--dsv4c MODE] <LightLLM's
arguments>`` runs this module as ``__main__`` (through the package's ``__main__``).

LightLLM starts its router and model workers with ``spawn``; a spawned process first re-runs the launching
process's main module by name, as ``__mp_main__``, but skips one named ``<package>.__main__``. So the launcher's
code lives here, in a module of its own name: in every process LightLLM spawns from the launcher it runs
:func:`install_from_environment` (the mode travels in ``$DSV4C_LIGHTLLM``) before LightLLM's code.
"""

if __name__ == "__main__":  # the launching process
    from dsv4_compressor.integrations.lightllm import main as _main

    _main()
elif __name__ == "__mp_main__":  # a process LightLLM spawned from the launcher
    from dsv4_compressor.integrations.lightllm import install_from_environment as _install_from_environment

    _install_from_environment()
