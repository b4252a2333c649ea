"""The top of the stack: the ``inferq`` command (``deploy.cli``) and the ``inferq up`` launcher
(``deploy.launcher``). It may import every other package; the shared core ``inferq/`` never imports it."""
