"""Gradient compressors whose output training consumes and the log stores (LowDiff's reuse):
the compressor contract and top-k (:mod:`.topk`), TernGrad and QSGD (:mod:`.quantized`), the
DeMo optimizer and its compressor (:mod:`.demo`), and fast top-k selection (:mod:`.select`).
Imports only :mod:`..core`."""
