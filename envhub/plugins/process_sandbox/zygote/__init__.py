"""The zygote: the warm process every process-sandbox interpreter is forked from.

Its modules run in two places. The node imports them as this package (for the frame
format it shares with the zygote). The zygote itself runs as a script under
``python -I`` on the sandbox's interpreter, which may have no envhub installed, so
nothing here imports envhub or anything outside the standard library.
"""
