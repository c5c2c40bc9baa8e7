"""The ground floor: C kernels and their ctypes wrappers, paged attention, huge-page allocation.

Imports no specserve package above it; models, sampling and drafters take their kernels from here.
"""
