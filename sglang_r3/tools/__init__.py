"""Commands built on the extension: ``r3 demo``, ``r3 rl-demo``, ``r3 mismatch-report``
(registered with the ``r3`` CLI by :mod:`sglang_r3.tools.commands`), and the local stack
they run on (:mod:`sglang_r3.tools.local_stack`).  SGLang never imports these."""
