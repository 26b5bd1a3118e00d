"""Stepping: the optimizer side of a RoundPipe -- the owner the model talks to
(``owner``), the masters, the optimizer thread (``stepper``), weight versions, the
layer-wise step, overlapped iterations (``pipelined``) and the disk tier. Outside this
package only its face is used (``tests/core/test_layering.py`` checks it).
"""
