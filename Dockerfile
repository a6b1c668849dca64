# One image for both roles: `ferry-api` and `ferry-worker` are its entrypoints (see docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY common common
RUN pip install --no-cache-dir .
ENV FERRY_HOME=/models HOST=0.0.0.0 PORT=8080
EXPOSE 8080
CMD ["ferry-api"]
