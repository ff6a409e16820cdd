package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/worker-dev/worker/internal/broker"
	kafkabroker "github.com/worker-dev/worker/internal/broker/kafka"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/obs"
)

const (
	// probeBase is the first wait before probing brokers that were down.
	probeBase = 100 * time.Millisecond
	// commitTimeout bounds an offset commit, which outlives Run's context:
	// the records' work has committed, and saying so spares a redelivery.
	commitTimeout = 10 * time.Second
)

// Source consumes a Kafka consumer group into the inbox.
type Source struct {
	cfg      inboxconfig.KafkaSource
	section  string // inbox.sources[<name>].kafka, for errors
	topics   []string
	batch    int
	probeMax time.Duration
	// rebalance bounds how long the group waits for members to rejoin: a
	// live one rejoins once its batch is settled, one round of which the
	// inbox's lease bounds, so waiting longer mostly waits for a dead one
	// (see the package comment).
	rebalance time.Duration
	log       *slog.Logger
}

var _ inbox.Source = (*Source)(nil)

// New checks src's kafka section and returns the source; Run connects.
// batch_size and probe_backoff_max come from cfg.
func New(src inboxconfig.SourceConfig, cfg inboxconfig.Config, log *slog.Logger) (*Source, error) {
	section := "inbox.sources[" + src.Name + "].kafka"
	c := src.Kafka
	var topics []string
	for t := range strings.SplitSeq(c.Topics, ",") {
		if t = strings.TrimSpace(t); t != "" {
			topics = append(topics, t)
		}
	}
	switch {
	case strings.TrimSpace(c.Brokers) == "":
		return nil, fmt.Errorf("%s.brokers is empty: want host:port[,host:port...]", section)
	case len(topics) == 0:
		return nil, fmt.Errorf("%s.topics is empty: want topic[,topic...]", section)
	case c.Group == "":
		return nil, fmt.Errorf("%s.group is empty: replicas that share a group share the partitions", section)
	case c.ConnectTimeout < 100*time.Millisecond:
		return nil, fmt.Errorf("%s.connect_timeout=%s: want at least 100ms", section, c.ConnectTimeout)
	case c.SessionTimeout < time.Second:
		return nil, fmt.Errorf("%s.session_timeout=%s: want at least 1s, within the brokers' group.min.session.timeout.ms (6s by default)", section, c.SessionTimeout)
	case !slices.Contains([]string{"", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}, c.SASLMechanism):
		return nil, fmt.Errorf("%s.sasl_mechanism=%q: want PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or empty", section, c.SASLMechanism)
	case c.SASLMechanism != "" && c.SASLUser == "":
		return nil, fmt.Errorf("%s.sasl_user is empty: sasl_mechanism %s needs a user and password", section, c.SASLMechanism)
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return nil, fmt.Errorf("%s.tls_cert_file and %s.tls_key_file: set both for a client certificate, or neither", section, section)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{
		cfg:       c,
		section:   section,
		topics:    topics,
		batch:     max(cfg.BatchSize, 1),
		probeMax:  max(cfg.ProbeBackoffMax, probeBase),
		rebalance: max(cfg.LeaseTTL, c.SessionTimeout),
		log:       log.With("inbox_source", src.Name, "source_kind", inboxconfig.KindKafka),
	}, nil
}

// options are the client's options: brokers, SASL and TLS from
// kafkabroker.AuthOptions, as the outbox's Kafka sink builds them, and a
// group whose offsets only Run commits.
func (s *Source) options() ([]kgo.Opt, error) {
	c := s.cfg
	opts := []kgo.Opt{
		kgo.SeedBrokers(strings.Split(strings.ReplaceAll(c.Brokers, " ", ""), ",")...),
		kgo.ClientID(c.ClientID),
		kgo.DialTimeout(c.ConnectTimeout),
		kgo.ConsumerGroup(c.Group),
		kgo.SessionTimeout(c.SessionTimeout),
		// Kafka's advice: heartbeat at most every third of the session.
		kgo.HeartbeatInterval(min(3*time.Second, c.SessionTimeout/3)),
		kgo.RebalanceTimeout(s.rebalance),
		kgo.ConsumeTopics(s.topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		// Revocations wait until the polled batch is processed and its
		// offsets committed: see the package comment.
		kgo.BlockRebalanceOnPoll(),
		// A transactional producer's aborted records are never work.
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	}
	auth, err := kafkabroker.AuthOptions(s.section, kafkabroker.Auth{
		SASLMechanism: c.SASLMechanism, SASLUser: c.SASLUser, SASLPassword: c.SASLPassword,
		TLS: c.TLS, TLSCAFile: c.TLSCAFile, TLSCertFile: c.TLSCertFile, TLSKeyFile: c.TLSKeyFile,
	})
	if err != nil {
		return nil, err
	}
	return append(opts, auth...), nil
}

// Run implements inbox.Source: poll a batch, hand it to the inbox, commit
// what it settled, let a rebalance through, again. A poll or a commit
// that fails for the brokers reports the source down; it is up again once
// a broker answers.
func (s *Source) Run(ctx context.Context, h inbox.Handoff) error {
	opts, err := s.options()
	if err != nil {
		return fmt.Errorf("%w: %w", broker.ErrSetup, err)
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", broker.ErrSetup, s.section, err)
	}
	defer cl.Close()
	if err := s.probe(ctx, cl, h, s.check(ctx, cl)); err != nil || ctx.Err() != nil {
		return err
	}
	for strikes := 0; ; {
		fetches := cl.PollRecords(ctx, s.batch)
		if ctx.Err() != nil {
			cl.AllowRebalance()
			return nil
		}
		trouble := s.pollError(fetches)
		if broker.Fatal(trouble) {
			cl.AllowRebalance()
			return trouble
		}
		if recs := fetches.Records(); len(recs) > 0 {
			if err := s.process(ctx, cl, h, recs); err != nil && trouble == nil {
				trouble = err
			}
		}
		cl.AllowRebalance()
		if trouble == nil {
			strikes = 0
			continue
		}
		// A first error may be stale: the client reported it while the
		// brokers were away, and it is polled after their return. It is
		// an outage only if they do not answer now.
		if strikes++; strikes == 1 {
			if trouble = s.check(ctx, cl); trouble == nil {
				continue
			}
		}
		strikes = 0
		if err := s.probe(ctx, cl, h, trouble); err != nil || ctx.Err() != nil {
			return err
		}
	}
}

// probe reports the source up when trouble is nil. Otherwise it reports
// it down and asks the brokers again, with jittered backoff, until they
// answer (then up, nil), the answer is one no retry fixes (that error),
// or ctx ends (nil).
func (s *Source) probe(ctx context.Context, cl *kgo.Client, h inbox.Handoff, trouble error) error {
	for failures := 0; trouble != nil; {
		if broker.Fatal(trouble) {
			return trouble
		}
		h.Down(trouble)
		failures++
		if !obs.Sleep(ctx, obs.FullJitter(probeBase, s.probeMax, failures)) {
			return nil
		}
		trouble = s.check(ctx, cl)
	}
	h.Up()
	return nil
}

// check asks a broker for the topics' metadata: it answers, it accepts the
// credentials, and the topics exist.
func (s *Source) check(ctx context.Context, cl *kgo.Client) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout)
	defer cancel()
	req := kmsg.NewPtrMetadataRequest()
	req.AllowAutoTopicCreation = false
	for _, t := range s.topics {
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return s.classify(err)
	}
	for _, t := range resp.Topics {
		err := kerr.ErrorForCode(t.ErrorCode)
		switch {
		case err == nil:
		case errors.Is(err, kerr.UnknownTopicOrPartition):
			return fmt.Errorf("%w: %s.topics: topic %q does not exist on %s", broker.ErrSetup, s.section, *t.Topic, s.cfg.Brokers)
		default:
			return s.classify(fmt.Errorf("topic %q: %w", *t.Topic, err))
		}
	}
	return nil
}

// classify tells what retrying cannot fix from an outage: what
// kafkabroker.ConnectVerdict sorts out, or a session timeout outside the
// brokers' bounds. Any other error is the brokers' trouble.
func (s *Source) classify(err error) error {
	if verdict := kafkabroker.ConnectVerdict(s.section, s.cfg.Brokers, s.cfg.SASLMechanism, err); verdict != nil {
		return verdict
	}
	if errors.Is(err, kerr.InvalidSessionTimeout) {
		return fmt.Errorf("%w: kafka %s: %s.session_timeout=%s is outside the brokers' group.min.session.timeout.ms and group.max.session.timeout.ms: %w",
			broker.ErrSetup, s.cfg.Brokers, s.section, s.cfg.SessionTimeout, err)
	}
	return fmt.Errorf("kafka %s: %w", s.cfg.Brokers, err)
}

// pollError returns the first error a poll reported, classified, or nil.
// The end of ctx is not an error.
func (s *Source) pollError(fetches kgo.Fetches) error {
	for _, fe := range fetches.Errors() {
		if errors.Is(fe.Err, context.Canceled) || errors.Is(fe.Err, context.DeadlineExceeded) {
			continue
		}
		if errors.Is(fe.Err, kerr.UnknownTopicOrPartition) {
			return fmt.Errorf("%w: %s.topics: topic %q: %w", broker.ErrSetup, s.section, fe.Topic, fe.Err)
		}
		return s.classify(fe.Err)
	}
	return nil
}
