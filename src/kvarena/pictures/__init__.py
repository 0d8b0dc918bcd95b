"""Pictures where people would rather look than read: the memory map, the budget
curve, a replay's timeline, and a report page that holds them.

:mod:`.bands` (what a memory map shows, pure) and :mod:`.files` (where output
goes) import no plotting library; :mod:`.canvas` is the one module that
touches matplotlib, and only when a picture is asked for, so ``import
kvarena`` and the commands that draw nothing never load it.
"""
