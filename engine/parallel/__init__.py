"""The RoundPipe engine's moving parts: one worker thread per device running its schedule's stages,
the optimizer thread that owns the fp32 weights in host memory, and the transfers between them
(``engine.roundpipe`` assembles them).
"""
