"""Exports for other runtimes: GGUF files for llama.cpp and Ollama.

- ``formats.py``: the export formats a checkpoint is delivered in (its own files, merged, GGUF with
  its quantizations): the one registry the CLI, the API and the web UI read.
- ``gguf_quants.py``: the GGUF quantizations written, the one list.

- ``gguf_families.py``: per family, the llama.cpp architecture, the tensor layout changes it
  expects and the metadata it reads; what a family cannot express is refused by name.
- ``gguf_vocab.py``: the tokenizer as GGUF metadata (tokens, merges, pre-tokenizer, special
  tokens, chat template).
- ``gguf_pre_tokenizers.py``: llama.cpp's pre-tokenizer table (the check text, each known
  tokenizer's hash and name, the names its loader accepts), with the llama.cpp commit it is from.
- ``gguf_model.py``: a merged model folder -> one GGUF file (f16, bf16, q8_0, q4_k_m); a PEFT
  LoRA adapter -> a LoRA GGUF for use on a base GGUF.
- ``kquants.py``: the Q4_K and Q6_K block formats, which the ``gguf`` library reads but does not
  write.
- ``modelfile.py``: Ollama's ``Modelfile`` next to the GGUF.
"""
