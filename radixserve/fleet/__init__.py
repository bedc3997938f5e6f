"""Everything that launches or supervises several processes: ``serve --dp N`` (instances
behind the router, ``dp_launch``), the ``Supervisor`` that restarts them, and Ray Serve
(``ray_serve``, ``ray_cli``). It sits above ``server`` and ``router``, which know nothing of
each other; this room puts them together.
"""
