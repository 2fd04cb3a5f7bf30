"""The interactive API docs (`/docs`, Swagger UI) of every kvdir HTTP server, served from the server itself.

FastAPI's own page loads Swagger UI's JS and CSS from a CDN and its favicon from FastAPI's site,
so it is blank in an air-gapped cluster, the usual case for GPU clusters. The same files ship as
package data of `fastapi-offline` (pinned in pyproject.toml, the same Swagger UI 5 the CDN
serves); they are mounted under ASSETS and the page references no other host. ReDoc is off: one
UI is enough. Apps are made with `docs_url=None, redoc_url=None` and then `add_offline_docs(app)`,
FastAPI's documented way to self-host the docs' assets.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS = "/docs"
ASSETS = "/docs/assets"
_PACKAGE = ("fastapi_offline", "static")  # swagger-ui-bundle.js, swagger-ui.css, favicon.png


def add_offline_docs(app: FastAPI) -> None:
    """Serve Swagger UI at DOCS with its assets under ASSETS (a missing package fails here, at startup)."""
    app.mount(ASSETS, StaticFiles(packages=[_PACKAGE]), name="docs-assets")
    schema = app.openapi_url
    if schema is None:
        raise ValueError("the docs render the OpenAPI schema: the app must serve one")

    @app.get(DOCS, include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy that strips a prefix, as FastAPI's own page
        return get_swagger_ui_html(
            openapi_url=root + schema,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=None,
            swagger_ui_parameters={"validatorUrl": None},  # else Swagger UI may ask validator.swagger.io about the schema
        )
