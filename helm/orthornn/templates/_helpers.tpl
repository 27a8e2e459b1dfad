{{/* vim: set filetype=mustache: */}}

{{/* Chart name, truncated to 63 characters (DNS label limit). */}}
{{- define "orthornn.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release name already holds it. */}}
{{- define "orthornn.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "orthornn.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (app.kubernetes.io/*). */}}
{{- define "orthornn.labels" -}}
helm.sh/chart: {{ include "orthornn.chart" . }}
{{ include "orthornn.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: orthornn
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels: stable across upgrades (Deployment selectors are immutable). */}}
{{- define "orthornn.selectorLabels" -}}
app.kubernetes.io/name: {{ include "orthornn.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "orthornn.serverSelectorLabels" -}}
{{ include "orthornn.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "orthornn.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "orthornn.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* registry/repository:tag or @digest; an empty tag is "<appVersion>-<variant>". */}}
{{- define "orthornn.imageRef" -}}
{{- $image := index . 0 }}{{- $variant := index . 1 }}{{- $root := index . 2 }}
{{- $repo := $image.repository }}
{{- if $image.registry }}{{ $repo = printf "%s/%s" $image.registry $image.repository }}{{ end }}
{{- if $image.digest }}
{{- printf "%s@%s" $repo $image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default (printf "%s-%s" $root.Chart.AppVersion $variant) $image.tag) }}
{{- end }}
{{- end }}

{{- define "orthornn.image" -}}
{{- include "orthornn.imageRef" (list .Values.image (ternary "gpu" "cpu" .Values.gpu.enabled) .) }}
{{- end }}

{{- define "orthornn.trainImage" -}}
{{- include "orthornn.imageRef" (list .Values.retraining.image (ternary "gpu" "cpu" .Values.retraining.gpu.enabled) .) }}
{{- end }}

{{/* The model repository claim, shared by the server and the retraining jobs. */}}
{{- define "orthornn.claimName" -}}
{{- default (printf "%s-models" (include "orthornn.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{- define "orthornn.secretName" -}}
{{- default (include "orthornn.fullname" .) .Values.auth.existingSecret }}
{{- end }}

{{- define "orthornn.secretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}admin-token{{ end }}
{{- end }}

{{/* "true" when helm renders against a cluster (install, upgrade, --dry-run=server):
listing the namespace's Secrets then answers a list, even an empty one; without a cluster
(helm template, helm lint, Argo CD) lookup answers nothing. */}}
{{- define "orthornn.clusterReachable" -}}
{{- if lookup "v1" "Secret" .Release.Namespace "" }}true{{ end }}
{{- end }}

{{/* A secret value kept across renders (list: the root, the given value, the Secret's name,
its key, the length of a generated one, the failure message): the given value, else the
one already in the Secret, else, rendering against a cluster (a first install), a new
random one that later upgrades find there. Without a cluster (helm template, Argo CD) a
random value would change at every render: then the value must be given. */}}
{{- define "orthornn.keptSecret" -}}
{{- $root := index . 0 }}{{- $given := index . 1 }}{{- $name := index . 2 }}{{- $key := index . 3 }}
{{- if $given }}
{{- $given }}
{{- else }}
{{- $secret := lookup "v1" "Secret" $root.Release.Namespace $name }}
{{- if and $secret $secret.data (hasKey $secret.data $key) }}
{{- index $secret.data $key | b64dec }}
{{- else if include "orthornn.clusterReachable" $root }}
{{- randAlphaNum (index . 4) }}
{{- else }}
{{- fail (index . 5) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The admin token: the given one, else the one already in the release's Secret, else a new
random one on a first install (so upgrades keep it); helm template needs one given. */}}
{{- define "orthornn.adminToken" -}}
{{- include "orthornn.keptSecret" (list . .Values.auth.adminToken (include "orthornn.fullname" .) "admin-token" 40 "auth.adminToken is empty and there is no cluster to find the release's Secret in (helm template, helm lint, Argo CD): a token generated here would change at every render. Give one with --set auth.adminToken=$(openssl rand -hex 24), or create a Secret (kubectl create secret generic orthornn-admin --from-literal=admin-token=$(openssl rand -hex 24)) and set auth.existingSecret=orthornn-admin (docs/deployment.md, \"Secrets\")") }}
{{- end }}

{{/* A pod's settings of the bucket (modelRepository.uri): the endpoint and the region, as
the AWS tools read them. The keys come by envFrom (orthornn.bucketKeys), or else the pod's
web identity. Nothing without a bucket. */}}
{{- define "orthornn.bucketEnv" -}}
{{- $bucket := .Values.modelRepository }}
{{- if $bucket.uri }}
{{- with $bucket.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $bucket.region }}
- name: AWS_REGION
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY of the bucket, by reference to
modelRepository.existingSecret (an envFrom entry). */}}
{{- define "orthornn.bucketKeys" -}}
{{- $bucket := .Values.modelRepository }}
{{- if and $bucket.uri $bucket.existingSecret }}
- secretRef:
    name: {{ $bucket.existingSecret | quote }}
{{- end }}
{{- end }}

{{/* Cross-field checks the JSON schema cannot express. */}}
{{- define "orthornn.validate" -}}
{{- $drain := add .Values.lifecycle.shutdownDelaySeconds .Values.lifecycle.drainSeconds }}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $drain) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be greater than lifecycle.shutdownDelaySeconds + lifecycle.drainSeconds (%d)" (int .Values.terminationGracePeriodSeconds) (int $drain)) }}
{{- end }}
{{- if and .Values.modelRepository.uri .Values.capture.enabled (not .Values.capture.uri) }}
{{- fail "capture.enabled with modelRepository.uri needs capture.uri (s3://BUCKET/PREFIX, beside the repository, not inside it): there is no shared volume to capture to" }}
{{- end }}
{{- $repoPrefix := printf "%s/" (trimSuffix "/" .Values.modelRepository.uri) }}
{{- if and .Values.capture.uri .Values.modelRepository.uri (or (eq (trimSuffix "/" .Values.capture.uri) (trimSuffix "/" .Values.modelRepository.uri)) (hasPrefix $repoPrefix .Values.capture.uri)) }}
{{- fail (printf "capture.uri (%s) must not be modelRepository.uri or inside it (%s): the repository's listing would take the captures for models" .Values.capture.uri .Values.modelRepository.uri) }}
{{- end }}
{{- if and .Values.capture.uri (not .Values.modelRepository.uri) }}
{{- fail "capture.uri needs modelRepository.uri (the bucket's endpoint, region and credentials are modelRepository's); without it, captures go to the shared volume" }}
{{- end }}
{{- if and .Values.retraining.enabled (not .Values.persistence.enabled) (not .Values.modelRepository.uri) }}
{{- fail "retraining.enabled needs a model repository the jobs publish into: persistence.enabled (the shared volume) or modelRepository.uri (a bucket)" }}
{{- end }}
{{- if and .Values.retraining.enabled .Values.modelRepository.uri .Values.retraining.fromCaptures.enabled }}
{{- range $key := list "data" "corpus" }}
{{- $path := toString (index $.Values.retraining.trainConfig $key | default "") }}
{{- if or (eq $path $.Values.persistence.mountPath) (hasPrefix (printf "%s/" (trimSuffix "/" $.Values.persistence.mountPath)) $path) }}
{{- fail (printf "retraining.trainConfig.%s (%s) is on the models volume, which a repository in a bucket (modelRepository.uri) does not mount: put the original data in the training image or on a volume of retraining.extraVolumes / retraining.extraVolumeMounts" $key $path) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- fail "autoscaling.maxReplicas must be at least autoscaling.minReplicas" }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (not (kindIs "invalid" .Values.podDisruptionBudget.minAvailable)) (not (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable)) }}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable, not both (set the other to null)" }}
{{- end }}
{{- if and (eq .Values.sessions.store "external") (not .Values.sessions.external.url) }}
{{- fail "sessions.store=external needs sessions.external.url (redis://HOST[:PORT][/DB]; the password comes from sessions.external.existingSecret)" }}
{{- end }}
{{- if and .Values.ingress.sessionAffinity.enabled (not .Values.ingress.enabled) }}
{{- fail "ingress.sessionAffinity.enabled needs ingress.enabled: the affinity is an annotation of the chart's Ingress (ingress-nginx)" }}
{{- end }}
{{- $live := .Values.retraining }}
{{- if and $live.enabled (or $live.trigger.enabled $live.fromCaptures.enabled) }}
{{- if not .Values.capture.enabled }}
{{- fail "retraining.trigger.enabled and retraining.fromCaptures.enabled read the captures: they need capture.enabled" }}
{{- end }}
{{- if $live.distributed.enabled }}
{{- fail "retraining.trigger and retraining.fromCaptures run in a one-pod job: set retraining.distributed.enabled=false" }}
{{- end }}
{{- end }}
{{- if and $live.enabled $live.fromCaptures.enabled }}
{{- if not $live.gate.enabled }}
{{- fail "retraining.fromCaptures.enabled needs retraining.gate.enabled: the candidate is judged on the held-out captured slice (orthornn export --gate --gate-data)" }}
{{- end }}
{{- $task := toString $live.trainConfig.task }}
{{- if not (has $task (list "classify" "lm")) }}
{{- fail (printf "retraining.fromCaptures.enabled needs retraining.trainConfig.task classify (with retraining.trainConfig.data, the original .npz) or lm (with retraining.trainConfig.corpus, the original text corpus): the tasks orthornn capture dataset writes data sets for; got task %q" $task) }}
{{- end }}
{{- $key := ternary "corpus" "data" (eq $task "lm") }}
{{- $original := index $live.trainConfig $key }}
{{- if not $original }}
{{- if eq $task "lm" }}
{{- fail "retraining.fromCaptures.enabled with retraining.trainConfig.task=lm needs retraining.trainConfig.corpus (the original text corpus, e.g. on the models volume, trained on beside the captured one; its vocabulary is the model's)" }}
{{- else }}
{{- fail "retraining.fromCaptures.enabled with retraining.trainConfig.task=classify needs retraining.trainConfig.data (the original .npz, e.g. on the models volume, trained on beside the captures)" }}
{{- end }}
{{- end }}
{{- if or (not (kindIs "string" $original)) (not (regexMatch "^[^\\s\"'`$\\\\*?[]+$" $original)) }}
{{- fail (printf "retraining.trainConfig.%s must be one path, without spaces, quotes, $, backslashes or wildcards (*?[), with retraining.fromCaptures.enabled (the job's script adds the captured file after it); got %v" $key $original) }}
{{- end }}
{{- if and (eq $task "lm") (not (kindIs "invalid" $live.fromCaptures.dataMix)) }}
{{- fail (printf "retraining.fromCaptures.dataMix applies only to retraining.trainConfig.task=classify (train --data-mix); a language model reads its corpora as one stream: set it to null (the default) for task lm; got %v" $live.fromCaptures.dataMix) }}
{{- end }}
{{- if not (kindIs "invalid" $live.fromCaptures.dataMix) }}
{{- $mix := float64 $live.fromCaptures.dataMix }}
{{- if or (le $mix 0.0) (ge $mix 1.0) }}
{{- fail (printf "retraining.fromCaptures.dataMix must be a number in (0, 1); got %v" $live.fromCaptures.dataMix) }}
{{- end }}
{{- end }}
{{- end }}
{{- $rollout := .Values.retraining.rollout }}
{{- if $rollout.enabled }}
{{- if not .Values.retraining.gate.enabled }}
{{- fail "retraining.rollout.enabled needs retraining.gate.enabled: a rollout takes a candidate that passed the gate (orthornn export --gate --rollout)" }}
{{- end }}
{{- $previous := 0 }}
{{- range $rollout.steps }}
{{- if le (int .) $previous }}
{{- fail (printf "retraining.rollout.steps must be increasing percentages ending at 100 (e.g. [5, 25, 50, 100]); got %v" $rollout.steps) }}
{{- end }}
{{- $previous = int . }}
{{- end }}
{{- if ne $previous 100 }}
{{- fail (printf "retraining.rollout.steps must be increasing percentages ending at 100 (e.g. [5, 25, 50, 100]); got %v" $rollout.steps) }}
{{- end }}
{{- /* the schema lets decimal strings through (helm --set keeps 0.95 a string) */}}
{{- range $key, $range := dict "shadow" (list 0.0 1.0) "minAgreement" (list 0.0 1.0) "maxErrorRate" (list 0.0 1.0) "maxLatencyRatio" (list 1.0 1000.0) }}
{{- $value := float64 (index $rollout $key) }}
{{- if or (lt $value (index $range 0)) (gt $value (index $range 1)) }}
{{- fail (printf "retraining.rollout.%s must be a number in [%v, %v]; got %v" $key (index $range 0) (index $range 1) (index $rollout $key)) }}
{{- end }}
{{- end }}
{{- if and .Values.retraining.enabled (gt (int $rollout.timeoutSeconds) 0) (ge (int $rollout.timeoutSeconds) (int .Values.retraining.activeDeadlineSeconds)) }}
{{- fail (printf "retraining.rollout.timeoutSeconds (%d) must be below retraining.activeDeadlineSeconds (%d): the job also trains and exports before the rollout" (int $rollout.timeoutSeconds) (int .Values.retraining.activeDeadlineSeconds)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod template of the retraining CronJob and Job. */}}
{{- define "orthornn.retrainingPod" -}}
{{- $r := .Values.retraining -}}
{{- $gate := $r.gate -}}
{{- $rollout := $r.rollout -}}
{{- $trigger := $r.trigger -}}
{{- $captured := $r.fromCaptures -}}
{{- $live := or $trigger.enabled $captured.enabled -}}
{{- /* fromCaptures: a classifier's captures are an .npz (train --data), a language
model's a text corpus (train --corpus) */ -}}
{{- $lm := eq (toString $r.trainConfig.task) "lm" -}}
{{- $flag := ternary "corpus" "data" $lm -}}
{{- $ext := ternary "txt" "npz" $lm -}}
metadata:
  labels:
    {{- include "orthornn.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: retraining
    {{- with $r.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/train-config: {{ toYaml $r.trainConfig | sha256sum }}
    {{- with $r.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  restartPolicy: Never
  {{- if $r.distributed.enabled }}
  # <job>-<index>.<this subdomain>: the Indexed Job's pods find pod 0, the rendezvous
  subdomain: {{ include "orthornn.retrainingWorkers" . }}
  {{- end }}
  serviceAccountName: {{ include "orthornn.serviceAccountName" . }}
  automountServiceAccountToken: false
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- $nodeSelector := $r.nodeSelector }}
  {{- if $r.gpu.enabled }}{{ $nodeSelector = merge (deepCopy $r.nodeSelector) .Values.gpu.nodeSelector }}{{ end }}
  {{- with $nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := $r.tolerations }}
  {{- if $r.gpu.enabled }}{{ $tolerations = concat $r.tolerations .Values.gpu.tolerations }}{{ end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $r.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: retrain
      image: {{ include "orthornn.trainImage" . }}
      imagePullPolicy: {{ $r.image.pullPolicy }}
      command: ["/bin/sh", "-ec"]
      args:
        - |
          run="/runs/${ORTHORNN_MODEL_NAME}-$(date -u +%Y%m%dT%H%M%SZ)"
          {{- if $live }}
          reason=schedule
          {{- end }}
          {{- if $trigger.enabled }}
          # retrain only on drift or enough new labels, outside the cooldown (exit 1: nothing to do)
          set +e
          orthornn retrain-trigger --capture "$ORTHORNN_CAPTURES" --repo "$ORTHORNN_REPO" --name "$ORTHORNN_MODEL_NAME" --min-labels {{ int $trigger.minLabels | quote }} --cooldown {{ $trigger.cooldownHours | toString | quote }} {{ ternary "--drift" "--no-drift" $trigger.onDrift }} --reason-file /tmp/retrain-reason
          status=$?
          set -e
          if [ "$status" -eq 1 ]; then
            echo "retraining: nothing to do for ${ORTHORNN_MODEL_NAME} (orthornn retrain-trigger exit 1); the promoted version keeps serving" >&2
            exit 0
          fi
          if [ "$status" -ne 0 ]; then exit "$status"; fi
          reason=$(cat /tmp/retrain-reason)
          {{- end }}
          {{- if $captured.enabled }}
          data=""
          gate_data=""
          if [ "$reason" != first ]; then
            # the labelled captures: the older part to train on, the newest slice held out
            orthornn capture dataset --capture "$ORTHORNN_CAPTURES" --name "$ORTHORNN_MODEL_NAME" --repo "$ORTHORNN_REPO" --out /runs/captured.{{ $ext }} --holdout /runs/captured-holdout.{{ $ext }} --no-progress
            data="--{{ $flag }} {{ index $r.trainConfig $flag }} --{{ $flag }} /runs/captured.{{ $ext }}{{ if not (kindIs "invalid" $captured.dataMix) }} --data-mix {{ $captured.dataMix }}{{ end }}"
            gate_data="--gate-data /runs/captured-holdout.{{ $ext }}"
            if [ "$reason" = drift ]; then
              # drift was the trigger: the candidate must be better on the shifted inputs
              gate_data="$gate_data --require-better-on-gate-data"
            fi
          fi
          orthornn train --config /config/train.yaml --out "$run" --no-progress $data
          {{- else }}
          orthornn train --config /config/train.yaml --out "$run" --no-progress
          {{- end }}
          {{- include "orthornn.distributedTrainFlags" . }}
          {{- if $r.distributed.enabled }}
          if [ ! -f "$run/summary.json" ]; then
            # every pod trained; the one that ran rank 0 holds the run and exports it, once
            echo "retraining: training done; the pod of rank 0 exports the run" >&2
            exit 0
          fi
          {{- end }}
          set +e
          orthornn export "$run" --repo "$ORTHORNN_REPO" --name "$ORTHORNN_MODEL_NAME" --mode "$ORTHORNN_EXPORT_MODE"
          {{- if $gate.enabled }} --gate
          {{- if not (kindIs "invalid" $gate.minMetric) }} --min-metric {{ $gate.minMetric | toString | quote }}{{ end }}
          {{- if $gate.tolerance }} --tolerance {{ $gate.tolerance | toString | quote }}{{ end }}
          {{- if $captured.enabled }} $gate_data{{ end }}
          {{- if $rollout.enabled }} --rollout --shadow {{ $rollout.shadow | toString | quote }} --steps {{ join "," $rollout.steps | quote }} --interval {{ int $rollout.intervalSeconds | quote }} --min-requests {{ int $rollout.minRequests | quote }} --min-agreement {{ $rollout.minAgreement | toString | quote }} --max-error-rate {{ $rollout.maxErrorRate | toString | quote }} --max-latency-ratio {{ $rollout.maxLatencyRatio | toString | quote }}{{ end }}
          {{- end }}
          status=$?
          set -e
          if [ "$status" -eq 3 ]; then
            # exit 3: the gate refused the candidate. A completed run that published
            # nothing, not a failure: no retry, and the promoted version keeps serving.
            echo "retraining: the gate refused the candidate of ${ORTHORNN_MODEL_NAME} (export exit 3); nothing published, the promoted version keeps serving" >&2
            exit 0
          fi
          {{- if $rollout.enabled }}
          if [ "$status" -ne 0 ]; then exit "$status"; fi
          # export started the candidate's rollout (unless no version was promoted yet: then
          # it promoted it at once). Its controller adds every serving replica's measurements
          # (the headless Service) and advances, promotes or rolls back, until it ends.
          if orthornn rollout status --repo "$ORTHORNN_REPO" --name "$ORTHORNN_MODEL_NAME" --json | grep -q '^  "state": "running"'; then
            set +e
            orthornn rollout run --repo "$ORTHORNN_REPO" --name "$ORTHORNN_MODEL_NAME" --replicas "$ORTHORNN_ROLLOUT_REPLICAS" --timeout {{ int $rollout.timeoutSeconds | quote }}
            status=$?
            set -e
            if [ "$status" -eq 3 ]; then
              # exit 3: rolled back (a threshold broke) or aborted by hand. An outcome, as a
              # gate refusal: the job completes and the promoted version keeps serving.
              echo "retraining: the rollout of ${ORTHORNN_MODEL_NAME}'s candidate ended without promoting it (rollout run exit 3, see orthornn rollout status); the promoted version keeps serving" >&2
              exit 0
            fi
            if [ "$status" -ne 0 ]; then
              # the controller gave up (--timeout) or failed: no rollout is left running
              # without one; the promoted version keeps serving
              orthornn rollout abort --repo "$ORTHORNN_REPO" --name "$ORTHORNN_MODEL_NAME" || true
            fi
          fi
          {{- end }}
          exit "$status"
      {{- with include "orthornn.bucketKeys" . }}
      envFrom:
        {{- . | nindent 8 }}
      {{- end }}
      env:
        # the repository: the shared volume, or the bucket (modelRepository.uri)
        - name: ORTHORNN_REPO
          value: {{ .Values.modelRepository.uri | default .Values.persistence.mountPath | quote }}
        {{- include "orthornn.bucketEnv" . | nindent 8 }}
        - name: ORTHORNN_MODEL_NAME
          value: {{ $r.modelName | quote }}
        - name: ORTHORNN_EXPORT_MODE
          value: {{ $r.exportMode | quote }}
        {{- if $live }}
        - name: ORTHORNN_CAPTURES
          value: {{ .Values.capture.uri | default $captured.mountPath | quote }}
        {{- end }}
        {{- if $rollout.enabled }}
        - name: ORTHORNN_ROLLOUT_REPLICAS
          value: {{ printf "dns:%s.%s.svc:%d" (include "orthornn.headlessName" .) .Release.Namespace (int .Values.containerPort) | quote }}
        {{- end }}
        {{- if $r.distributed.enabled }}
        - name: JOB_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['batch.kubernetes.io/job-name']
        {{- end }}
        - name: HOME
          value: /tmp
        - name: MPLCONFIGDIR
          value: /tmp/matplotlib
        {{- with $r.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      securityContext:
        {{- toYaml .Values.containerSecurityContext | nindent 8 }}
      resources:
        {{- $resources := deepCopy $r.resources }}
        {{- if $r.gpu.enabled }}
        {{- $limits := merge (default dict $resources.limits) (dict .Values.gpu.resourceName $r.gpu.count) }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        {{- if not .Values.modelRepository.uri }}
        - name: models
          mountPath: {{ .Values.persistence.mountPath }}
        {{- end }}
        - name: train-config
          mountPath: /config
          readOnly: true
        - name: runs
          mountPath: /runs
        - name: tmp
          mountPath: /tmp
        {{- if and $live (not .Values.capture.uri) }}
        # the models volume's captures/ folder, read-only: the trigger and the data set read it
        - name: models
          mountPath: {{ $captured.mountPath }}
          subPath: captures
          readOnly: true
        {{- end }}
        {{- with $r.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- if not .Values.modelRepository.uri }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ include "orthornn.claimName" . }}
    {{- end }}
    {{- with $r.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    - name: train-config
      configMap:
        name: {{ include "orthornn.fullname" . }}-train
    - name: runs
      emptyDir:
        sizeLimit: {{ $r.runsVolume.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.tmpVolume.sizeLimit }}
{{- end }}

{{/* The bundled Redis of the sessions (sessions.store=bundled): its Deployment, Service
and Secret. */}}
{{- define "orthornn.redisName" -}}
{{- printf "%s-redis" (include "orthornn.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "orthornn.redisImage" -}}
{{- include "orthornn.imageRef" (list .Values.sessions.bundled.image "" .) }}
{{- end }}

{{/* The bundled Redis's password: the given one, else the one already in its Secret, else a
new random one on a first install (so upgrades keep it, and the sessions with it); helm
template needs one given. */}}
{{- define "orthornn.redisPassword" -}}
{{- include "orthornn.keptSecret" (list . .Values.sessions.bundled.password (include "orthornn.redisName" .) "redis-password" 32 "sessions.bundled.password is empty and there is no cluster to find the bundled Redis's Secret in (helm template, helm lint, Argo CD): a password generated here would change at every render. Give one with --set sessions.bundled.password=$(openssl rand -hex 24) (docs/deployment.md, \"Secrets\")") }}
{{- end }}

{{/* The server's session store environment: ORTHORNN_SESSION_STORE, a redis:// URL without
a password, and ORTHORNN_SESSION_STORE_PASSWORD from the Secret (secretKeyRef: the
password never appears in the pod spec or the ConfigMap), which the service
percent-encodes into the URL (any character works). Nothing for sessions.store=memory. */}}
{{- define "orthornn.sessionEnv" -}}
{{- $s := .Values.sessions }}
{{- if ne $s.store "memory" }}
{{- $secret := "" }}
{{- $key := "" }}
{{- $url := "" }}
{{- if eq $s.store "bundled" }}
{{- $secret = include "orthornn.redisName" . }}
{{- $key = "redis-password" }}
{{- $url = printf "redis://%s:6379/0" (include "orthornn.redisName" .) }}
{{- else }}
{{- $secret = $s.external.existingSecret }}
{{- $key = $s.external.existingSecretKey }}
{{- $url = $s.external.url }}
{{- end }}
{{- if $secret }}
- name: ORTHORNN_SESSION_STORE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
{{- end }}
- name: ORTHORNN_SESSION_STORE
  value: {{ $url | quote }}
{{- end }}
{{- end }}

{{/* ingress-nginx's variable of a request header: $http_ and the name in lower case with
dashes as underscores. */}}
{{- define "orthornn.nginxHeaderVariable" -}}
{{- printf "$http_%s" (.Values.ingress.sessionAffinity.header | lower | replace "-" "_") }}
{{- end }}

{{/* PromQL label matchers of this release's series (rules and dashboard): the labels the
ServiceMonitor's targets get from prometheus-operator (namespace, service), unless
metrics.selector says otherwise. */}}
{{- define "orthornn.promSelector" -}}
{{- default (printf "namespace=\"%s\",service=\"%s\"" .Release.Namespace (include "orthornn.fullname" .)) .Values.metrics.selector }}
{{- end }}

{{/* The headless Service of the serving pods (retraining.rollout.enabled): its DNS name
resolves to every ready replica, which the rollout's controller polls. */}}
{{- define "orthornn.headlessName" -}}
{{- printf "%s-headless" (include "orthornn.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* Data-parallel retraining (retraining.distributed.enabled): the headless Service whose
DNS names the Indexed Job's pods (<job>-<index>.<service>) reach each other by, and the
flags of the launcher each pod runs: torchrun's c10d rendezvous at pod 0, gloo or nccl by
device. */}}
{{- define "orthornn.retrainingWorkers" -}}
{{- printf "%s-retrain" (include "orthornn.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "orthornn.distributedTrainFlags" -}}
{{- $r := .Values.retraining }}
{{- $d := $r.distributed }}
{{- if $d.enabled }}
{{- if and $r.gpu.enabled (gt (int $d.nprocPerNode) (int $r.gpu.count)) }}
{{- fail (printf "retraining.distributed.nprocPerNode (%d) must be at most retraining.gpu.count (%d): nccl runs one worker per GPU" (int $d.nprocPerNode) (int $r.gpu.count)) }}
{{- end -}}
{{- printf " --nnodes %d --nproc-per-node %d" (int $d.nodes) (int $d.nprocPerNode) }}
{{- printf " --rdzv-endpoint \"${JOB_NAME}-0.%s:%d\"" (include "orthornn.retrainingWorkers" .) (int $d.port) }}
{{- printf " --max-restarts %d --backend %s --dist-timeout-s %d" (int $d.maxRestarts) (ternary "nccl" "gloo" $r.gpu.enabled) (int $d.timeoutSeconds) }}
{{- end }}
{{- end }}
