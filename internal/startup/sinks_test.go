package startup

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// Every sink goes through the one table: an unknown name, a bad section
// and a publish timeout that does not fit in_flight_timeout exit 78 naming
// the key as the operator set it.
func TestSinkTableValidates(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		env  []string
		want string
	}{
		{[]string{"APP_OUTBOX_SINK=kafkaa"}, `APP_OUTBOX_SINK="kafkaa": want one of kafka, log, nats, rabbitmq, river, webhook`},
		{[]string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_TOPIC=a/{aggregate_type}"}, `APP_OUTBOX_KAFKA_TOPIC="a/{aggregate_type}"`},
		{[]string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_SASL_MECHANISM=GSSAPI"}, `APP_OUTBOX_KAFKA_SASL_MECHANISM="GSSAPI"`},
		{[]string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_TOPIC=__{aggregate_type}"},
			`APP_OUTBOX_KAFKA_TOPIC="__{aggregate_type}": want a topic that starts with neither '_' nor '.': names starting with "__" are Kafka's own`},
		{[]string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_PUBLISH_TIMEOUT=20s"}, "2.5 x the kafka sink's publish timeout (20s)"},
		{[]string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_PUBLISH_TIMEOUT=13s"}, "2.5 x the rabbitmq sink's publish timeout (13s)"},
		{[]string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_ROUTING_KEY={type}"}, `APP_OUTBOX_RABBITMQ_ROUTING_KEY="{type}": unknown placeholder`},
		{[]string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_URL=http://x"}, `APP_OUTBOX_RABBITMQ_URL="http://x"`},
		// On the default exchange the routing key is a queue's name: an event
		// value at its start would choose the queue.
		{[]string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_EXCHANGE="},
			`outbox.rabbitmq.routing_key="{aggregate_type}.{event_type}": with the default exchange (APP_OUTBOX_RABBITMQ_EXCHANGE="") the routing key is a queue's name, so it must start with literal text`},
		{[]string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_DECLARE_EXCHANGE=true", "APP_OUTBOX_RABBITMQ_EXCHANGE_TYPE=fan"}, `APP_OUTBOX_RABBITMQ_EXCHANGE_TYPE="fan"`},
		{[]string{"APP_OUTBOX_SINK=webhook"}, "outbox.webhook.url is empty"},
		{[]string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=http://x", "APP_OUTBOX_WEBHOOK_TIMEOUT=20s"}, "outbox.in_flight_timeout=30s: want at least 2.5 x the webhook sink's publish timeout (20s)"},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_PUBLISH_TIMEOUT=15s"}, "outbox.in_flight_timeout=30s: want at least 2.5 x the nats sink's publish timeout (15s)"},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_SUBJECT={prefix}.{aggregate}"}, `APP_OUTBOX_NATS_SUBJECT="{prefix}.{aggregate}": unknown placeholder {aggregate}`},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_SUBJECT_PREFIX=a.>"}, `APP_OUTBOX_NATS_SUBJECT_PREFIX="a.>"`},
		// The subject's first token is the operator's: an event value there
		// could reach the server's own subjects ($JS.API..., _INBOX...).
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_SUBJECT={aggregate_type}.{aggregate_id}.{event_type}"},
			`APP_OUTBOX_NATS_SUBJECT="{aggregate_type}.{aggregate_id}.{event_type}": the first token must be literal text`},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_SUBJECT=_INBOX.{aggregate_type}"},
			`APP_OUTBOX_NATS_SUBJECT="_INBOX.{aggregate_type}": the subject's first token "_INBOX" starts with "_": want one that starts with neither '$'`},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_SUBJECT_PREFIX=$JS"},
			`APP_OUTBOX_NATS_SUBJECT_PREFIX="$JS": the subject's first token "$JS" starts with "$"`},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_TOKEN=t", "APP_OUTBOX_NATS_CREDS_FILE=/c"}, "user, token, nkey_seed_file and creds_file are alternatives"},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_MAX_PENDING=0"}, "APP_OUTBOX_NATS_MAX_PENDING=0: want at least 1"},
	} {
		_, err := LoadConfig(writeFile(t, "{}"), c.env)
		if ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: got %v (exit %d), want exit 78 with %q", c.env, err, ExitCode(err), c.want)
		}
	}
	for _, name := range []string{"nats", "rabbitmq", "kafka"} {
		if _, err := LoadConfig(writeFile(t, "{}"), []string{"APP_OUTBOX_SINK=" + name}); err != nil {
			t.Errorf("%s with its defaults: %v", name, err)
		}
	}
}

// The redelivery gap covers the longest backoff the relay can draw and the
// takeover of a vanished relay's claims, plus one publish.
func TestRedeliveryGap(t *testing.T) {
	t.Parallel()
	c := outboxconfig.DefaultConfig() // base 1s, 3 attempts: at most 2s of backoff
	if got, want := redeliveryGap(c, 5*time.Second), c.InFlightTimeout+5*time.Second; got != want {
		t.Errorf("defaults: %s, want %s", got, want)
	}
	c.MaxAttempts = 20 // the backoff reaches backoff_max (5m)
	if got, want := redeliveryGap(c, time.Second), c.BackoffMax+time.Second; got != want {
		t.Errorf("20 attempts: %s, want %s", got, want)
	}
}

// Broker credentials are masked by `config print`, each sink's while it is
// the one selected: another sink's settings stop the start.
func TestSinkSecretsMasked(t *testing.T) {
	t.Parallel()
	cases := map[string][]string{
		"url-pass-1 tok-in-url-2 nats-pass-3": {
			"APP_OUTBOX_SINK=nats",
			"APP_OUTBOX_NATS_URL=nats://relay:url-pass-1@n1:4222,nats://tok-in-url-2@n2:4222",
			"APP_OUTBOX_NATS_USER=relay", "APP_OUTBOX_NATS_PASSWORD=nats-pass-3",
		},
		"amqp-pass-4": {"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_URL=amqps://app:amqp-pass-4@mq:5671/prod"},
		"sasl-pass-5": {
			"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_BROKERS=k1:9092",
			"APP_OUTBOX_KAFKA_SASL_MECHANISM=PLAIN", "APP_OUTBOX_KAFKA_SASL_USER=app", "APP_OUTBOX_KAFKA_SASL_PASSWORD=sasl-pass-5",
		},
	}
	for secrets, env := range cases {
		cfg, err := LoadConfig(writeFile(t, "{}"), env)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if err := config.Print(&out, cfg.Config); err != nil {
			t.Fatal(err)
		}
		for s := range strings.FieldsSeq(secrets) {
			if strings.Contains(out.String(), s) {
				t.Errorf("config print leaks %q:\n%s", s, out.String())
			}
		}
	}
}
