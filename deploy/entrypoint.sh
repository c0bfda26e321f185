#!/bin/sh
# Fetch the model into $LEYLINE_HOME (a no-op once it is there), then serve it; arguments
# go to `leyline serve`.
set -e
leyline model fetch "$LEYLINE_MODEL"
exec leyline serve "$@"
