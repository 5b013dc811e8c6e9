"""A ``go.FigureWidget`` redrawn in place from a new figure: its traces replaced and its
layout brought to the new one's in one batch update, so the front end redraws once.

Only the layout's top-level properties that differ are set: plotly validates a whole new
layout's template again, some 30 ms a figure, for a template that stays the same. plotly
sends a shown widget the edits alone; the state a front end that connects later draws
from (Voila's page, a notebook's saved widget state) is brought up to date too.

Example::

    >>> import plotly.graph_objects as go
    >>> widget = go.FigureWidget(go.Bar(y=[1, 2], name="old"))
    >>> replace_figure(widget, go.Figure(go.Scatter(y=[3], name="new"), layout_title_text="t"))
    >>> [t.name for t in widget.data], widget.layout.title.text
    (['new'], 't')
    >>> widget.get_state()["_widget_data"][0]["name"]
    'new'
"""

import json
from copy import deepcopy

import plotly.graph_objects as go
from plotly.utils import PlotlyJSONEncoder

__all__ = ["replace_figure"]


def replace_figure(widget: go.FigureWidget, figure: go.Figure) -> None:
    """Show ``figure`` in ``widget``: its traces and layout replace the widget's (the
    whole layout when the widget's has a property that ``figure``'s lacks)."""
    old, new = widget.layout.to_plotly_json(), figure.layout.to_plotly_json()
    with widget.batch_update():
        widget.data = []
        widget.add_traces(figure.data)
        if old.keys() <= new.keys():
            widget.layout.update({k: v for k, v in new.items()
                                  if k not in old or _json(old[k]) != _json(v)}, overwrite=True)
        else:
            widget.layout = figure.layout
    widget._widget_data = deepcopy(widget._data)  # as plotly's own _repr_mimebundle_ does
    widget._widget_layout = deepcopy(widget._layout_obj._props)


def _json(value) -> str:
    """``value`` as plotly writes it (arrays too), to compare two properties."""
    return json.dumps(value, cls=PlotlyJSONEncoder, sort_keys=True)
