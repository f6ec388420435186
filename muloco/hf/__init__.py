"""Hugging Face interop: ``config.json`` read and written, torchtitan's state-dict adapter, LLaDA's
folders, the tokenizer conversion, and the remote-code files an export ships (``remote_code/``)."""
