"""A ``go.FigureWidget`` redrawn in place from a new figure: its traces and layout
replaced in one batch update, so the front end redraws once.

Example::

    >>> import plotly.graph_objects as go
    >>> widget = go.FigureWidget(go.Bar(y=[1, 2], name="old"))
    >>> replace_figure(widget, go.Figure(go.Scatter(y=[3], name="new"), layout_title_text="t"))
    >>> [t.name for t in widget.data], widget.layout.title.text
    (['new'], 't')
"""

import plotly.graph_objects as go

__all__ = ["replace_figure"]


def replace_figure(widget: go.FigureWidget, figure: go.Figure) -> None:
    """Show ``figure`` in ``widget``: its traces and layout replace the widget's."""
    with widget.batch_update():
        widget.data = []
        widget.add_traces(figure.data)
        widget.layout = figure.layout
