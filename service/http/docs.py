"""/docs (Swagger UI) and /redoc served offline: their JavaScript and CSS come from the
pinned ``fastapi-offline`` package (serve extra) and are served by the service itself
under /docs/assets, so the pages name no external URL and work in a cluster without
internet access."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS_PACKAGE = "fastapi_offline"  # ships swagger-ui-bundle.js, swagger-ui.css, redoc
ASSETS = "/docs/assets"
FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def assets_dir() -> Path:
    """The folder of the pinned package's static files (without importing the package)."""
    spec = importlib.util.find_spec(ASSETS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named {ASSETS_PACKAGE!r}", name=ASSETS_PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise ModuleNotFoundError(f"{ASSETS_PACKAGE} lacks {', '.join(missing)}",
                                  name=ASSETS_PACKAGE)
    return folder


def add_docs(app: FastAPI, openapi_url: str = "/openapi.json") -> None:
    """GET /docs, /docs/oauth2-redirect and /redoc, with their assets under /docs/assets."""
    app.mount(ASSETS, StaticFiles(directory=assets_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url, title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=root + "/docs/oauth2-redirect",
            # no badge fetched from validator.swagger.io
            swagger_ui_parameters={"validatorUrl": None})

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_redoc_html(openapi_url=root + openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
                              with_google_fonts=False)
