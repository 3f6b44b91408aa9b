"""A Django project in one file that streams a weightq job to the browser as server-sent events.

    pip install weightq django && python django_app.py runserver  # then open http://127.0.0.1:8000

In a real project `ask` lives in a views.py. Tokens arrive as `data: {"text": ...}` events, then one
`end` event with the result (or an `error` event); if the browser leaves, Django closes the response
and the job is cancelled (Job.sse). An async view can return `job.asse()` the same way.
"""

import sys
from pathlib import Path

from django.conf import settings

if not settings.configured:
    settings.configure(DEBUG=True, ROOT_URLCONF=__name__, SECRET_KEY="example-only", ALLOWED_HOSTS=["*"])

from django.http import HttpResponse, StreamingHttpResponse
from django.urls import path
from weightq.client import Client
from weightq.client.sse import HEADERS

client = Client()


def page(request):
    return HttpResponse((Path(__file__).parent / "static" / "ask.html").read_text())


def ask(request):
    job = client.submit(messages=[{"role": "user", "content": request.GET["q"]}], max_new_tokens=256)
    return StreamingHttpResponse(job.sse(timeout=120), content_type="text/event-stream", headers=HEADERS)


urlpatterns = [path("", page), path("ask", ask)]

if __name__ == "__main__":
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
