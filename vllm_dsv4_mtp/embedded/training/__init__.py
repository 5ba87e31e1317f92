"""How the embedded model was made: its recipe, the training loop, the export to the native layout and the
accuracy / MTP-agreement report. Not installed by the wheel (serving never needs it); run from the repository.
"""
