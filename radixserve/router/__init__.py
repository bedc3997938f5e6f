"""The fleet router: spreads requests over radixserve instances by cache affinity and load.

``policy`` (pure: the policies, shared with the simulator and Ray Serve), ``index`` (which
worker holds which blocks), ``load`` (per-worker load), and the HTTP front in ``app``.
"""
