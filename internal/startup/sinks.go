package startup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	kafkasink "github.com/worker-dev/worker/internal/outbox/sink/kafka"
	natssink "github.com/worker-dev/worker/internal/outbox/sink/nats"
	rabbitsink "github.com/worker-dev/worker/internal/outbox/sink/rabbitmq"
	riversink "github.com/worker-dev/worker/internal/outbox/sink/river"
	webhooksink "github.com/worker-dev/worker/internal/outbox/sink/webhook"
)

// sinkKind is what startup knows about one value of outbox.sink.
type sinkKind struct {
	// validate checks the sink's own section (outbox.<sink>), without
	// connecting.
	validate func(outboxconfig.Config) error
	// new builds the sink and, for a broker, connects within its
	// connect_timeout.
	new func(ctx context.Context, env sinkEnv) (outbox.Sink, error)
	// publishTimeout bounds one Publish; 0 for a sink that cannot hang.
	publishTimeout func(outboxconfig.Config) time.Duration
}

// sinkEnv is what a sink may need from the process.
type sinkEnv struct {
	cfg    *runConfig
	stdout io.Writer
	log    *slog.Logger
}

// sinkKinds is every sink, by its outbox.sink name.
var sinkKinds = map[string]sinkKind{
	outboxconfig.SinkLog: {
		validate:       func(outboxconfig.Config) error { return nil },
		new:            func(_ context.Context, env sinkEnv) (outbox.Sink, error) { return outbox.NewLogSink(env.stdout), nil },
		publishTimeout: func(outboxconfig.Config) time.Duration { return 0 },
	},
	outboxconfig.SinkWebhook: {
		validate: func(c outboxconfig.Config) error {
			if err := c.Webhook.Validate(); err != nil {
				return err
			}
			_, err := newWebhookSink(c.Webhook)
			return err
		},
		new: func(_ context.Context, env sinkEnv) (outbox.Sink, error) {
			return newWebhookSink(env.cfg.Outbox.Webhook)
		},
		publishTimeout: func(c outboxconfig.Config) time.Duration { return c.Webhook.Timeout },
	},
	outboxconfig.SinkNATS: {
		validate: func(c outboxconfig.Config) error {
			_, err := natssink.New(c.NATS, natssink.Options{})
			return err
		},
		new: func(ctx context.Context, env sinkEnv) (outbox.Sink, error) {
			c := env.cfg.Outbox
			s, err := natssink.New(c.NATS, natssink.Options{
				Name:          "worker " + env.cfg.Instance.ID,
				RedeliveryGap: redeliveryGap(c, c.NATS.PublishTimeout),
				Logger:        env.log,
			})
			if err != nil {
				return nil, err
			}
			return connectBroker(ctx, s, "outbox.nats.connect_timeout", c.NATS.ConnectTimeout)
		},
		publishTimeout: func(c outboxconfig.Config) time.Duration { return c.NATS.PublishTimeout },
	},
	outboxconfig.SinkRabbitMQ: {
		validate: func(c outboxconfig.Config) error {
			_, err := rabbitsink.New(c.RabbitMQ, rabbitsink.Options{})
			return err
		},
		new: func(ctx context.Context, env sinkEnv) (outbox.Sink, error) {
			c := env.cfg.Outbox.RabbitMQ
			s, err := rabbitsink.New(c, rabbitsink.Options{Name: "worker " + env.cfg.Instance.ID, Logger: env.log})
			if err != nil {
				return nil, err
			}
			return connectBroker(ctx, s, "outbox.rabbitmq.connect_timeout", c.ConnectTimeout)
		},
		publishTimeout: func(c outboxconfig.Config) time.Duration { return c.RabbitMQ.PublishTimeout },
	},
	outboxconfig.SinkKafka: {
		validate: func(c outboxconfig.Config) error {
			_, err := kafkasink.New(c.Kafka, kafkasink.Options{})
			return err
		},
		new: func(ctx context.Context, env sinkEnv) (outbox.Sink, error) {
			c := env.cfg.Outbox.Kafka
			s, err := kafkasink.New(c, kafkasink.Options{Logger: env.log})
			if err != nil {
				return nil, err
			}
			return connectBroker(ctx, s, "outbox.kafka.connect_timeout", c.ConnectTimeout)
		},
		publishTimeout: func(c outboxconfig.Config) time.Duration { return c.Kafka.PublishTimeout },
	},
	// The routes' targets are checked against tasks.kinds in Config.validate.
	outboxconfig.SinkRiver: {
		validate: func(c outboxconfig.Config) error {
			if len(c.River.Routes) == 0 {
				return fmt.Errorf(`%s is empty: sink river needs a task kind per event type, or a "*" default`, outboxconfig.RoutesKey)
			}
			return nil
		},
		new: func(_ context.Context, env sinkEnv) (outbox.Sink, error) {
			return riversink.New(env.cfg.Tasks, env.cfg.Outbox.River.Routes)
		},
		publishTimeout: func(outboxconfig.Config) time.Duration { return 0 },
	},
}

// validateSink checks outbox.sink and its section. A claim transaction
// starts publishes only in the first 45% of in_flight_timeout and cancels
// them at 90%, so every sink's publish must fit in it.
// A custom sink (ext) has no section of its own; it must honour the
// publish context's deadline.
func validateSink(c outboxconfig.Config, ext Extensions) error {
	if _, ok := ext.Sinks[c.Sink]; ok {
		return checkIdleSinkSettings(c)
	}
	kind, ok := sinkKinds[c.Sink]
	if !ok {
		names := slices.Concat(slices.Collect(maps.Keys(sinkKinds)), slices.Collect(maps.Keys(ext.Sinks)))
		return config.Errorf("outbox.sink=%q: want one of %s", c.Sink, strings.Join(slices.Sorted(slices.Values(names)), ", "))
	}
	if err := checkIdleSinkSettings(c); err != nil {
		return err
	}
	if err := kind.validate(c); err != nil {
		var ce *config.Error
		if errors.As(err, &ce) {
			return err
		}
		return config.Errorf("%w", err)
	}
	if t := kind.publishTimeout(c); c.InFlightTimeout < t*5/2 {
		return config.Errorf("outbox.in_flight_timeout=%s: want at least 2.5 x the %s sink's publish timeout (%s), so a publish always has its full timeout",
			c.InFlightTimeout, c.Sink, t)
	}
	return nil
}

// checkIdleSinkSettings refuses settings of a sink other than the one
// outbox.sink selects, such as outbox.webhook.url with the log sink: the
// operator meant that sink, and the selected one would publish, and mark
// published, every event the intended one never receives. A setting counts
// as given when it differs from its default, so a file that lists every key
// with its default (configs/worker.yaml) passes.
func checkIdleSinkSettings(c outboxconfig.Config) error {
	def := reflect.ValueOf(outboxconfig.DefaultConfig())
	got := reflect.ValueOf(c)
	var msgs []string
	for i := range got.NumField() {
		section := got.Type().Field(i).Tag.Get("koanf")
		if _, isSink := sinkKinds[section]; !isSink || section == c.Sink {
			continue
		}
		set := changedKeys("outbox."+section, got.Field(i), def.Field(i))
		if len(set) == 0 {
			continue
		}
		verb := "is"
		if len(set) > 1 {
			verb = "are"
		}
		msgs = append(msgs, fmt.Sprintf("%s %s set, but outbox.sink=%q%s: the %s sink's settings apply only with outbox.sink=%s; select that sink, or leave them at their defaults",
			strings.Join(set, ", "), verb, c.Sink, defaultNote(c.Sink == outboxconfig.DefaultConfig().Sink), section, section))
	}
	if len(msgs) > 0 {
		return config.Errorf("%s", strings.Join(msgs, "\n"))
	}
	return nil
}

func defaultNote(isDefault bool) string {
	if isDefault {
		return " (the default)"
	}
	return ""
}

// changedKeys are the keys under prefix whose value in got differs from
// def, the same struct's defaults.
func changedKeys(prefix string, got, def reflect.Value) []string {
	if got.Kind() != reflect.Struct {
		if reflect.DeepEqual(got.Interface(), def.Interface()) || (got.Kind() == reflect.Map && got.Len() == 0 && def.Len() == 0) {
			return nil
		}
		return []string{prefix}
	}
	var keys []string
	for i := range got.NumField() {
		keys = append(keys, changedKeys(prefix+"."+got.Type().Field(i).Tag.Get("koanf"), got.Field(i), def.Field(i))...)
	}
	return keys
}

// newSink builds the configured sink (connected, for a broker).
func newSink(ctx context.Context, cfg *runConfig, stdout io.Writer, log *slog.Logger) (outbox.Sink, error) {
	if custom, ok := cfg.ext.Sinks[cfg.Outbox.Sink]; ok {
		return custom(ctx)
	}
	return sinkKinds[cfg.Outbox.Sink].new(ctx, sinkEnv{cfg: cfg, stdout: stdout, log: log})
}

// redeliveryGap is the longest time between two publishes of one event
// that the relay itself causes: a publish whose answer was lost, retried
// after the longest backoff it can draw, or a claim of a vanished relay
// taken over after in_flight_timeout. A broker's deduplication window must
// cover it (an operator's `dead retry` can always come later).
func redeliveryGap(c outboxconfig.Config, publishTimeout time.Duration) time.Duration {
	longestBackoff := c.BackoffBase
	for i := 2; i < c.MaxAttempts && longestBackoff < c.BackoffMax; i++ {
		longestBackoff *= 2
	}
	return max(min(longestBackoff, c.BackoffMax), c.InFlightTimeout) + publishTimeout
}

// brokerSink is a sink that connects to a broker before its first publish.
type brokerSink interface {
	outbox.Sink
	Connect(ctx context.Context) error
}

// connectBroker connects s, trying for at most timeout (the sink's
// connect_timeout, named by key in the error).
func connectBroker(ctx context.Context, s brokerSink, key string, timeout time.Duration) (outbox.Sink, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := s.Connect(ctx); err != nil {
		return nil, brokerError(err, key, timeout)
	}
	return s, nil
}

// brokerError maps a broker sink's start failure to its exit code: 69 when
// the broker stayed unreachable, 77 when it refused the credentials, 78
// when the configuration does not fit it.
func brokerError(err error, timeoutKey string, timeout time.Duration) error {
	switch {
	case errors.Is(err, broker.ErrRefused):
		return &ExitError{Code: ExitNoPerm, Msg: err.Error(), Err: err}
	case errors.Is(err, broker.ErrSetup):
		return &config.Error{Msg: err.Error(), Err: err}
	default:
		return &ExitError{Code: ExitUnavailable, Msg: fmt.Sprintf("%v (waited %s=%s, %s)", err, timeoutKey, timeout, config.Env(timeoutKey)), Err: err}
	}
}

// closer is a sink that holds a connection: Close runs after the relay
// has shut down.
type closer interface {
	Close(ctx context.Context) error
}

// sinkRelay is the relay component with its sink's lifecycle: the sink is
// closed after the relay stopped. /readyz does not ask the sink: see
// readiness.
type sinkRelay struct {
	*outbox.Relay
	sink outbox.Sink
}

func (r sinkRelay) Shutdown(ctx context.Context) error {
	err := r.Relay.Shutdown(ctx)
	if c, ok := r.sink.(closer); ok {
		err = errors.Join(err, c.Close(ctx))
	}
	return err
}

// newWebhookSink builds the webhook sink. Its errors show the URL as
// `config print` does: user info and query string (often a token) masked.
func newWebhookSink(cfg outboxconfig.WebhookConfig) (*webhooksink.Sink, error) {
	s, err := webhooksink.New(cfg, nil)
	if err != nil {
		// The cause is left out on purpose: its text carries the raw URL.
		return nil, &config.Error{Msg: obs.MaskDSN(err.Error())}
	}
	return s, nil
}
