package main

import (
	"encoding/csv"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

var csvHeader = []string{"round", "load1", "phase", "events", "rate", "commit_rate", "expected_rate",
	"p50_ms", "p99_ms", "max_ms", "db_cpu_us_per_event", "worker_cpu_us_per_event"}

func writeCSV(path string, rows []row) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	_ = w.Write(csvHeader)
	num := func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }
	for _, r := range rows {
		_ = w.Write([]string{strconv.Itoa(r.round), num(r.load), r.phase, strconv.Itoa(r.events),
			num(r.rate), num(r.commitRate), num(r.expected), num(r.p50), num(r.p99), num(r.max),
			num(r.dbCPU), num(r.workerCPU)})
	}
	w.Flush()
	if err := w.Error(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// figure is one line of the table: a value per round.
type figure struct {
	name, target string
	values       []float64
}

// figures derives the table's lines from the rows: each phase's own
// figures, then the ratios taken within a round.
func figures(o options, rows []row) []figure {
	byRound := map[int]map[string]result{}
	var order []string
	for _, r := range rows {
		if byRound[r.round] == nil {
			byRound[r.round] = map[string]result{}
		}
		byRound[r.round][r.phase] = r.result
		if !slices.Contains(order, r.phase) {
			order = append(order, r.phase)
		}
	}
	slices.SortStableFunc(order, func(a, b string) int { return phaseRank(a) - phaseRank(b) })
	var figs []figure
	add := func(name, target string, f func(m map[string]result) (float64, bool)) {
		fig := figure{name: name, target: target}
		for round := 1; round <= o.rounds; round++ {
			if v, ok := f(byRound[round]); ok && !math.IsNaN(v) && !math.IsInf(v, 0) {
				fig.values = append(fig.values, v)
			}
		}
		if len(fig.values) > 0 {
			figs = append(figs, fig)
		}
	}
	ratio := func(a, b string, commit bool) func(m map[string]result) (float64, bool) {
		return func(m map[string]result) (float64, bool) {
			x, ok1 := m[a]
			y, ok2 := m[b]
			if commit {
				return x.commitRate / y.commitRate, ok1 && ok2
			}
			return x.rate / y.rate, ok1 && ok2
		}
	}
	add("default (log-1x1) ÷ loop, first to last", "≥ 0.7", ratio("log-1x1", "loop", false))
	add("default (log-1x1) ÷ loop, from the commit", "", ratio("log-1x1", "loop", true))
	add("log-1x1-multi ÷ loop, first to last", "≥ 0.7", ratio("log-1x1-multi", "loop", false))
	add("log-1x1-multi ÷ loop, from the commit", "", ratio("log-1x1-multi", "loop", true))
	add("webhook-1x1 ÷ loop, first to last", "", ratio("webhook-1x1", "loop", false))
	add("webhook-1x1-multi ÷ loop, first to last", "", ratio("webhook-1x1-multi", "loop", false))
	add("log-2x2-multi ÷ log-1x2-multi, first to last", "≥ 0.9", ratio("log-2x2-multi", "log-1x2-multi", false))
	for _, p := range order {
		if strings.HasPrefix(p, "slow-") {
			add(p+" from the commit ÷ (max_in_flight ÷ latency)", "≥ 0.8", func(m map[string]result) (float64, bool) {
				r, ok := m[p]
				return r.commitRate / r.expected, ok
			})
		}
	}
	for _, p := range order {
		get := func(f func(result) float64) func(m map[string]result) (float64, bool) {
			return func(m map[string]result) (float64, bool) { r, ok := m[p]; return f(r), ok && f(r) > 0 }
		}
		switch {
		case strings.HasPrefix(p, "latency-"):
			target := map[string]string{"latency-500": "≤ 5", "latency-2000": "≤ 10"}[p]
			add(p+" p50 ms", "", get(func(r result) float64 { return r.p50 }))
			add(p+" p99 ms", target, get(func(r result) float64 { return r.p99 }))
			add(p+" max ms", "", get(func(r result) float64 { return r.max }))
		default:
			add(p+" events/s, first to last", "", get(func(r result) float64 { return r.rate }))
			if !strings.HasPrefix(p, "loop") {
				add(p+" events/s, from the commit", "", get(func(r result) float64 { return r.commitRate }))
			}
		}
		add(p+" database CPU µs/event", "", get(func(r result) float64 { return r.dbCPU }))
		add(p+" worker CPU µs/event", "", get(func(r result) float64 { return r.workerCPU }))
	}
	return figs
}

// phaseRank orders the table: the loop, the drains, latency, slow.
func phaseRank(p string) int {
	switch {
	case p == "loop":
		return 0
	case strings.HasPrefix(p, "latency-"):
		return 2
	case strings.HasPrefix(p, "slow-"):
		return 3
	}
	return 1
}

func printTable(w io.Writer, o options, rows []row) {
	loads := make([]float64, 0, len(rows))
	for _, r := range rows {
		loads = append(loads, r.load)
	}
	lo, med, hi := spread(loads)
	fmt.Fprintf(w, "\n%d round(s), %d events over %d aggregates per drain; load average (1 min) %.2f / %.2f / %.2f (min / median / max)\n\n",
		o.rounds, o.events, o.aggregates, lo, med, hi)
	fmt.Fprintln(w, "| figure | min | median | max | target |")
	fmt.Fprintln(w, "|---|---|---|---|---|")
	for _, f := range figures(o, rows) {
		lo, med, hi := spread(f.values)
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", f.name, format(lo), format(med), format(hi), f.target)
	}
}

func spread(v []float64) (lo, med, hi float64) {
	if len(v) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	s := slices.Sorted(slices.Values(v))
	med = s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[0], med, s[len(s)-1]
}

func format(v float64) string {
	switch {
	case math.Abs(v) >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case math.Abs(v) >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

// plotRates draws each drain phase's rate (first to last) per round, with
// its median as a bar.
func plotRates(path string, rows []row) error {
	var names []string
	for _, r := range rows {
		if r.rate > 0 && !strings.HasPrefix(r.phase, "slow-") && !slices.Contains(names, r.phase) {
			names = append(names, r.phase)
		}
	}
	slices.SortStableFunc(names, func(a, b string) int { return phaseRank(a) - phaseRank(b) })
	p := plot.New()
	p.Title.Text = "Drain rate of the worker binary beside the minimal loop"
	p.Y.Label.Text = "events/s (first to last delivery)"
	medians := make(plotter.Values, len(names))
	var points plotter.XYs
	for i, n := range names {
		var v []float64
		for _, r := range rows {
			if r.phase == n {
				v = append(v, r.rate)
				points = append(points, plotter.XY{X: float64(i), Y: r.rate})
			}
		}
		_, medians[i], _ = spread(v)
	}
	bars, err := plotter.NewBarChart(medians, vg.Points(30))
	if err != nil {
		return err
	}
	bars.LineStyle.Width = 0
	bars.Color = lightBlue
	dots, err := plotter.NewScatter(points)
	if err != nil {
		return err
	}
	p.Add(bars, dots)
	p.NominalX(names...)
	p.X.Tick.Label.Rotation = 0.5
	p.X.Tick.Label.XAlign = -0.9
	return p.Save(vg.Length(max(6, len(names)))*vg.Inch, 4*vg.Inch, path)
}

var lightBlue = color.RGBA{R: 0x9e, G: 0xc5, B: 0xe8, A: 0xff}
